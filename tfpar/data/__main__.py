"""`python -m tfpar.data prepare`: the command's name. Its code is tfpar.cli.data (docs/design.md, "Layers")."""

import runpy

if __name__ == "__main__":  # Importing it runs nothing.
  runpy.run_module("tfpar.cli.data", run_name="__main__", alter_sys=True)
