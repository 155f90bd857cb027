"""Example scripts that make each DataLoader failure happen for real under ``dlwatch.watch``.

Shipped inside the package as ``dlwatch._examples`` so that ``dlwatch demo`` finds
them after a normal install; run them as scripts, not as imports.
"""
