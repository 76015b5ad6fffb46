"""`python -m client chat`: an interactive chat with the served model (its chat template is applied
by the server: chat mode sends text_input = JSON list of messages with `chat: true`).

Type a message and Enter; `/reset` clears the history, `/exit` or Ctrl-D quits. With stdin not a
terminal, each line is one user turn (handy for scripts: `echo "Hi" | python -m client chat`).
"""
from __future__ import annotations

import json
import sys
import time

from client.generate import ServerError, generate, print_usage


def main(args) -> int:
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
        else:
            line = sys.stdin.readline()
            if not line:
                return 0
        line = line.strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            del history[int(bool(args.system)):]
            continue
        history.append({"role": "user", "content": line})
        fields = {"text_input": json.dumps(history), "chat": True, "stream": True,
                  "max_tokens": args.max_tokens, "temperature": args.temperature}
        if args.seed is not None:
            fields["seed"] = args.seed
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        t0 = time.perf_counter()
        try:
            out = generate(fields, args.protocol, args.url, args.model,
                           on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        except (ServerError, OSError) as e:
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            if not interactive:
                return 1
            continue
        history.append({"role": "assistant", "content": out["text"]})
        print_usage(out, time.perf_counter() - t0)
