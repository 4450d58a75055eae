"""Prepare a corpus: ``python launch/prepare.py [--config F.toml] [--data.corpus PATH] [--data.vocab_size N]``."""
from lab.data import prepare_main

raise SystemExit(prepare_main())
