"""Integrations with model libraries (each one imports its library lazily).

``vidsparse.integrations.diffusers``: sparse attention processors for diffusers video DiTs
(``apply_sparse_attention`` / ``remove_sparse_attention``).
"""
