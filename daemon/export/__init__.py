"""Models uploaded as exported programs (torch.export archives): the complete schema walk that
checks one (export_schema.py, sym_expr.py) and loading it (exported.py). The helper checks uploads
with it, a worker loads them: neither imports the other's package."""
