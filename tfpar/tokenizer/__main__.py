"""`python -m tfpar.tokenizer train`: the command's name. Its code is tfpar.cli.tokenizer (docs/design.md, "Layers")."""

import runpy

if __name__ == "__main__":  # Importing it runs nothing.
  runpy.run_module("tfpar.cli.tokenizer", run_name="__main__", alter_sys=True)
