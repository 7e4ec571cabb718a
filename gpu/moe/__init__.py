"""Mixture-of-experts layers: route -> group tokens by expert -> expert MLPs -> combine.

`routing.py` turns router logits into each token's experts and weights (as each
architecture's reference does); an implementation (registry kind `moe`) runs the experts.
"""
