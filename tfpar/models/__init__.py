"""Model families, one folder each (tfpar/models/<family>/: the model, its partitioning rules,
its keras-hub conversion), each registering itself with tfpar.families; and the protocol the
engines use of a model (tfpar.models.base). Importing this package imports no TensorFlow."""
