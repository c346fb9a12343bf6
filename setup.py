"""tfpar: train transformers in parallel on TensorFlow."""

from setuptools import find_packages, setup

setup(
    name="tfpar",
    version="0.1.0",
    description="Data, pipeline and tensor parallel transformer training on TensorFlow and Keras 3.",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<4",
        "absl-py>=2.1",
        "tensorboard",  # tf.summary writes through it; TF 2.21 no longer pulls it in.
        "numpy",
        "scikit-learn",  # The handwritten digits (sklearn.datasets.load_digits): vision data built in.
        "pycocotools",  # COCO mAP of detections, by the reference implementation.
        "pillow",  # PNG masks (palette indices) and predict's overlays.
        "pyyaml",  # python -m tfpar.k8s render prints YAML.
        "sentencepiece>=0.2",  # --tokenizer=sentencepiece:PATH and python -m tfpar.tokenizer train.
    ],
    extras_require={
        # The tests run scripts/bench.py's smoke test, which trains keras-hub's GPT2Backbone;
        # kubernetes (core kinds) and kubeflow-training (TFJob) validate the rendered manifests
        # offline, jsonschema against the CRD schemas where present; hypothesis drives the
        # property tests of the flag validator; pyflakes keeps the tree free of dead imports
        # (tests/test_layering.py); pytest-xdist runs two test files at once (one
        # core each: much of a test is one thread's work, a process starting or a step tracing).
        "test": ["pytest>=8", "pytest-xdist>=3", "keras-hub>=0.32", "kubernetes",
                 "kubeflow-training>=1.9", "jsonschema", "hypothesis>=6", "pyflakes"],
        "bench": ["keras-hub>=0.32", "matplotlib"],  # scripts/bench_dp.py draws its loss and bytes plot.
    },
)
