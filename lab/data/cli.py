"""``launch/prepare.py``: tokenize a corpus once and print what was prepared."""

from __future__ import annotations

import sys

from lab.runtime.config import ConfigError, build_parser, config_from_args
from lab.data.shards import DEFAULT_SHARD_TOKENS, prepare, summary


def prepare_main(argv: list[str] | None = None, prog: str = "launch/prepare.py") -> int:
    """Parse the shared command line, prepare ``[data]``, print a summary; 2 on a bad config."""
    parser = build_parser(prog, "Split a corpus, train its tokenizer and tokenize it into "
                                        "memory-mapped shards (reused when already prepared).")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help="most tokens per shard file")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args).data
        folder = prepare(cfg, progress=True, shard_tokens=args.shard_tokens)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(folder))
    return 0
