"""Kubernetes manifests for tfpar jobs, generated from flags and validated offline.

    python -m tfpar.k8s render --kind=jobset --name=gpt --workers=2 --image=IMAGE \\
        -- --strategy=multi_worker_mirrored --model_dir=gs://BUCKET/runs/gpt

`manifests.py` builds the objects as Python dicts; tfpar.cli.k8s validates the
render flags and the training flags (with tfpar.config, before TensorFlow is
imported) and prints the YAML. See docs/kubernetes.md.
"""
