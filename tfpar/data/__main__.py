"""python -m tfpar.data prepare: tokenize a corpus once into TFRecords (tfpar.data.prepared)."""

import sys

from tfpar.data import prepared

if __name__ == "__main__":
  prepared.main(sys.argv)
