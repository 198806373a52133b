"""What every stage does around its loop: start (mesh, console, seeds), inputs, resume and
fingerprints (stage), and the gold score on the held-out prompts (evaluation)."""
