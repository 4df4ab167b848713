"""The control plane: projects (tenants), service accounts, API keys, rate limits, spend limits and
usage, managed while the server runs through OpenAI's Admin API and shared by every replica
(:mod:`.store`: Redis or the node's SQLite file; :mod:`.state`: each process's current copy;
:mod:`.admin`: the operations; :mod:`.accounting`: spend reserved and settled, usage recorded;
:mod:`.usage`: the usage API's pages)."""
