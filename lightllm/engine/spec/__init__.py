"""Speculative decoding: draft sources propose tokens, the model runner verifies them in the
mixed step, and the controller decides per step how many drafts each request gets."""
