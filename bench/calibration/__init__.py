"""Calibration data for the tile model: published measurements and their sources (issue 15)."""
