"""Deployment files installed as package data (``trainguard.deploy``): the systemd unit of the node agent
(``trainguard-agent.service``) and its documented example configuration (``agent.toml``).

Find them with ``python -c "import trainguard.deploy as d, os; print(os.path.dirname(d.__file__))"``.
"""
