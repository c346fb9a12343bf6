"""`python -m tfpar.k8s render`: the command's name. Its code is tfpar.cli.k8s (docs/design.md, "Layers")."""

import runpy

if __name__ == "__main__":  # Importing it runs nothing.
  runpy.run_module("tfpar.cli.k8s", run_name="__main__", alter_sys=True)
