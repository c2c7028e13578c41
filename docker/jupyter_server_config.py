"""Jupyter server settings of the lab images (copied to /etc/jupyter/): listen on every
interface of the container, open no browser. Under JupyterHub, jupyterhub-singleuser
sets its own ip, port and base URL over these."""

c = get_config()  # noqa: F821  (provided by traitlets)
c.ServerApp.ip = "0.0.0.0"
c.ServerApp.open_browser = False
