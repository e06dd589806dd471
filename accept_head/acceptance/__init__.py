"""The acceptance head and its data: the head (SpecDec++ §3.2), token-level labels, weighted BCE, token mixing,
calibration, metrics of predicted acceptance and their figures."""
