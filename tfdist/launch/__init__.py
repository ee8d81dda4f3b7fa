"""Launching jobs: local loopback tasks, cluster commands."""
