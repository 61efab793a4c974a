"""Metrics, trackers and reports."""
