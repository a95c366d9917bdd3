"""The detokenizer process: token ids from the router in, text to the HTTP process out."""

from __future__ import annotations

import logging
import os

import zmq

from lightllm.engine.request import FinishReason, GenerateReq, TokenOut
from lightllm.frontend.decoder import IncrementalDecoder
from lightllm.frontend.tokenizer import load_tokenizer
from lightllm.server.config import ServerConfig
from lightllm.server.io_struct import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    ProcessReady,
    TextOut,
)
from lightllm.utils.process import freeze_startup_heap, init_child_process

logger = logging.getLogger(__name__)

SIGNAL_CHECK_MS = 500  # an idle detokenizer wakes this often (to let the stop signal's handler run)


class DetokenizationManager:
    def __init__(self, config: ServerConfig, tokenizer):
        self._tokenizer = tokenizer
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._decoders: dict[int, IncrementalDecoder] = {}
        context = zmq.Context.instance()
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(config.detokenization_address)
        self._to_http = context.socket(zmq.PUSH)
        self._to_http.setsockopt(zmq.SNDHWM, 0)
        self._to_http.connect(config.http_address)

    def close(self) -> None:
        for sock in (self._inbox, self._to_http):
            sock.close(linger=0)  # a socket with unsent messages would otherwise hold the exit

    def serve_forever(self) -> None:
        while True:
            # Wait in short polls, not one blocking recv: a signal may be delivered to another thread
            # (the tokenizer's), and Python runs its handler only when the main thread returns to it.
            if not self._inbox.poll(SIGNAL_CHECK_MS):
                continue
            msg = self._inbox.recv_pyobj()
            if isinstance(msg, GenerateReq):
                self._start(msg)
            elif isinstance(msg, BatchTokenOut):
                items = [out for out in map(self._detokenize, msg.items) if out is not None]
                if items:
                    self._to_http.send_pyobj(BatchTextOut(items))
            elif isinstance(msg, AbortReq):
                self._decoders.pop(msg.req_id, None)
            else:
                logger.error("unexpected message %r", type(msg).__name__)

    def _start(self, req: GenerateReq) -> None:
        sampling = req.sampling
        self._decoders[req.req_id] = IncrementalDecoder(
            self._tokenizer, sampling.skip_special_tokens, sampling.stop_sequences, sampling.include_stop_str_in_output
        )

    def _detokenize(self, out: TokenOut) -> TextOut | None:
        decoder = self._decoders.get(out.req_id)
        if decoder is None:  # ended here by a stop sequence, or aborted: drop its late tokens
            return None
        last = out.finish_reason is not None
        # An error carries no token: the request ends with the text it had.
        text = "" if out.finish_reason is FinishReason.ERROR else decoder.add(out.token_id, last=last)
        finish_reason = FinishReason.STOP if decoder.stopped else out.finish_reason
        if finish_reason is not None:
            del self._decoders[out.req_id]
        return TextOut(
            req_id=out.req_id,
            token_id=out.token_id,
            text=text,
            logprob=out.logprob,
            special=out.token_id in self._special_ids,
            count_output_tokens=len(decoder.ids),
            cached_tokens=out.cached_tokens,
            queue_time=out.queue_time,
            top_logprobs=None if out.top_logprobs is None else self._with_text(out.top_logprobs),
            prompt_logprobs=None if out.prompt_logprobs is None else [
                (logprob, rank, self._with_text(top)) for logprob, rank, top in out.prompt_logprobs],
            finish_reason=finish_reason,
            error=out.error,
        )

    def _with_text(self, top) -> list[tuple[int, str, float]]:
        """(token, its text alone, logprob): the text as OpenAI's logprobs show each token."""
        texts = self._tokenizer.batch_decode([[token] for token, _ in top], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False) if top else []
        return [(token, text, logprob) for (token, logprob), text in zip(top, texts)]


def start_detokenization_process(config: ServerConfig, ready_pipe, parent_pid: int) -> None:
    """Entry of the detokenizer process; reports ProcessReady on `ready_pipe`, then serves."""
    init_child_process(parent_pid, config.log_level)
    manager = DetokenizationManager(config, load_tokenizer(config))
    freeze_startup_heap()
    ready_pipe.send(ProcessReady("detokenizer"))
    logger.info("detokenizer ready (pid %d)", os.getpid())
    try:
        manager.serve_forever()  # until the stop signal
    finally:
        manager.close()
