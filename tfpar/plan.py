"""`python -m tfpar.plan`: the command's name. Its code is tfpar.cli.plan (docs/design.md, "Layers")."""

import runpy

if __name__ == "__main__":  # Importing it runs nothing.
  runpy.run_module("tfpar.cli.plan", run_name="__main__", alter_sys=True)
