"""``redsock plan`` and ``redsock calibrate``: a model of every all-reduce algorithm at any scale.

Layers: :mod:`.profile` (the measured constants), :mod:`.model` (pure arithmetic: time of one
all-reduce per algorithm), :mod:`.calibrate` (measures a profile with the existing benchmarks),
:mod:`.lab` (the model next to what ``redsock reproduce`` measured), :mod:`.k8s` (Kubernetes
manifests sized by the plan), :mod:`.command` (the ``plan`` command: tables, JSON, plot).
"""

from .model import ALGORITHMS, LABELS, Cluster, Prediction, fewest_reducers, predict, predict_all
from .profile import DEFAULT, Profile, load_profile

__all__ = ["ALGORITHMS", "DEFAULT", "LABELS", "Cluster", "Prediction", "Profile", "fewest_reducers",
           "load_profile", "predict", "predict_all"]
