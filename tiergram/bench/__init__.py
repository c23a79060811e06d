"""Measurement: every benchmark prints ratios against a baseline or limit measured in the same run."""
