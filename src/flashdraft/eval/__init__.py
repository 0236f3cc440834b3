"""Speculative decoding with a trained drafter: tau, acceptance, speed, and their report."""
