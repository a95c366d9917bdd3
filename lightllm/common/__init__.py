"""KV bookkeeping: the token table (token_table.py), request rows (req_table.py) and the prefix
cache's radix tree (radix_cache.py). Import from the modules: the radix tree is torch-free and
runs in the router process, which never imports torch."""
