"""The target model: its directory and fingerprint, loading it, its taps, random-weight targets."""
