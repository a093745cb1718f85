"""``python -m nvray.generate "Hello"``: offline generation from the command line.

With no --model it uses the embedded tiny model (random weights: the text is gibberish, the
machinery is real).
"""

from __future__ import annotations

import argparse
import json

from nvray import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nvray.generate", description=__doc__)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (default)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "usage": out.usage}))
        else:
            print(f"Prompt: {prompt!r}\nCompletion: {out.text!r} ({out.finish_reason})\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
