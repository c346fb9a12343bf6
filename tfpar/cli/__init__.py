"""The command-line tools: flags in, one validated call into the library, one line out on bad input.

Each `python -m tfpar.X` command runs the module of the same name here (the
runner at its old path only keeps the name; docs/design.md, "Command names").
`tool` holds what they share: one way to fail, print help and load a run.
"""
