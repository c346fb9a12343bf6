"""`python -m tfpar.export`: the command's name. Its code is tfpar.cli.export (docs/design.md, "Layers")."""

import runpy

if __name__ == "__main__":  # Importing it runs nothing.
  runpy.run_module("tfpar.cli.export", run_name="__main__", alter_sys=True)
