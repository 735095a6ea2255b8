"""Tests of the packaging and deployment files, and of a live Prometheus."""
