"""`python -m llmlab.train …`: the capstone command (see llmlab.train.capstone; `--help` lists the flags)."""

import sys

from llmlab.train.capstone import main

if __name__ == "__main__":
    sys.exit(main())
