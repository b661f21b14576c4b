"""The wire contract: `.proto` files under `pdserve/`, with their generated Python committed next to them.

Regenerate after editing a `.proto` with `python -m protos.generate`.
"""
