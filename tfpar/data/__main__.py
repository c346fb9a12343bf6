"""python -m tfpar.data prepare: tokenize a corpus once into a prepared set (tfpar.data.prepare)."""

import sys

from tfpar.data import prepare

if __name__ == "__main__":
  prepare.main(sys.argv)
