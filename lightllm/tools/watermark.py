"""Score a text for the watermark that /generate's `"watermark": true` puts in (lightllm/engine/watermark.py):
how many of its tokens are green after the token before them, and the z-score of that count
against chance (4 or more: watermarked, with a false-positive rate near 3e-5).

    python -m lightllm.tools.watermark --model_dir DIR "the text"
    python -m lightllm.tools.watermark --model_dir DIR --gamma 0.5 < text.txt

Give the server's --watermark_gamma (default 0.5) and its tokenizer's model directory; the text
as the server wrote it (the answer alone: its first token, which follows the prompt, is not
scored). Prints one JSON line: tokens scored, green, their fraction, z.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightllm.engine.watermark import GAMMA, score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="the served model's directory (its tokenizer)")
    parser.add_argument("--gamma", type=float, default=GAMMA, help="the server's --watermark_gamma")
    parser.add_argument("text", nargs="?", default=None, help="the text (default: standard input)")
    args = parser.parse_args(argv)
    if not 0 < args.gamma < 1:
        parser.error("--gamma must be above 0 and below 1")
    from lightllm.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
    text = sys.stdin.read() if args.text is None else args.text
    result = score(tokenizer.encode(text, add_special_tokens=False), args.gamma)
    print(json.dumps({"tokens_scored": result.scored, "green": result.green,
                      "green_fraction": round(result.green_fraction, 4), "z": round(result.z, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
