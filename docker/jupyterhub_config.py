"""JupyterHub for a class: one lab container per learner (DockerSpawner, the lab image).

    jupyterhub -f docker/jupyterhub_config.py        # on the Docker host, as root

What this file assumes (change it where yours differs):

- JupyterHub runs on the Docker host itself, not in a container, in an environment with
  `pip install jupyterhub dockerspawner` and `npm install -g configurable-http-proxy`, as a
  user who may use the Docker socket. Learner containers reach the hub at the address of
  the default bridge, docker0 (HUB_CONNECT_IP, default 172.17.0.1); the hub's API listens
  there only.
- The lab image is built and tagged: `minivllm/lab-cpu:latest` (MINIVLLM_LAB_IMAGE picks
  another, e.g. `minivllm/lab-cuda:latest` with MINIVLLM_HUB_GPUS=1 and the NVIDIA
  Container Toolkit on the host). The image has jupyterhub-singleuser (the `hub` extra);
  the hub here should have the same major version of JupyterHub.
- Learners log in with the hub's default authenticator (PAM: Unix accounts of the host).
  MINIVLLM_HUB_USERS and MINIVLLM_HUB_ADMINS are comma-separated user names; nobody else
  may log in. Put TLS in front of the hub (or set c.JupyterHub.ssl_key/ssl_cert).
- Each learner has a Docker volume `minivllm-user-<name>` as their home folder
  (/home/jovyan/work, the server's root); a link `minivllm` in it points at the course
  in the image (/opt/minivllm: chapters, labs). Edits to the chapters live in the container
  and go when the server stops; labs fetched with nbgrader's Assignment List, and anything
  else under work/, stay.
- nbgrader's exchange is the Docker volume `minivllm-exchange`, the one docker/compose.yaml
  and the grader use: the instructor releases, collects and autogrades with the grader
  image on that volume (docker/README.md). nbgrader names submissions by hub user.
  Every learner container runs as uid 1000, so file permissions do not keep learners out
  of each other's submissions in the exchange; where that matters, use per-user uids.
- Each server gets at most MINIVLLM_HUB_CPUS cores (2) and MINIVLLM_HUB_MEM memory (6G):
  a chapter runs the embedded model and its float32 reference side by side.
"""

import os

c = get_config()  # noqa: F821  (provided by traitlets)


def _names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


# The hub: the proxy on port 8000 of every interface; the hub's API on docker0 only.
c.JupyterHub.bind_url = "http://:8000"
c.JupyterHub.hub_ip = os.environ.get("HUB_CONNECT_IP", "172.17.0.1")
c.JupyterHub.hub_connect_ip = c.JupyterHub.hub_ip

c.Authenticator.allowed_users = _names("MINIVLLM_HUB_USERS")
c.Authenticator.admin_users = _names("MINIVLLM_HUB_ADMINS")

# One lab container per learner.
c.JupyterHub.spawner_class = "dockerspawner.DockerSpawner"
c.DockerSpawner.image = os.environ.get("MINIVLLM_LAB_IMAGE", "minivllm/lab-cpu:latest")
c.DockerSpawner.cmd = ["jupyterhub-singleuser"]  # not the image's `make lab`
c.DockerSpawner.remove = True  # a fresh container from the image at each start
notebook_dir = "/home/jovyan/work"
c.DockerSpawner.notebook_dir = notebook_dir
# ...and the server's working directory, not the image's WORKDIR (/opt/minivllm):
# nbgrader's Assignment List resolves assignment_dir "." and reads nbgrader_config.py in
# the working directory, where the repository's one-machine configuration would send
# every learner to /opt/minivllm/build/exchange ("Unwritable directory"). With this, the
# round trip worked on a DockerSpawner hub (alice 10/10, bob 8/10: the classroom issue's
# trial; not re-run here, no Docker engine on this machine).
c.DockerSpawner.extra_create_kwargs = {"working_dir": notebook_dir}
c.DockerSpawner.volumes = {
    "minivllm-user-{username}": notebook_dir,
    "minivllm-exchange": "/srv/nbgrader/exchange",
}
c.DockerSpawner.post_start_cmd = f"ln -sfn /opt/minivllm {notebook_dir}/minivllm"
c.DockerSpawner.cpu_limit = float(os.environ.get("MINIVLLM_HUB_CPUS", "2"))
c.DockerSpawner.mem_limit = os.environ.get("MINIVLLM_HUB_MEM", "6G")
c.Spawner.start_timeout = 120  # pulling or starting a ~3 GB image

if os.environ.get("MINIVLLM_HUB_GPUS") == "1":
    import docker

    c.DockerSpawner.extra_host_config = {
        "device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}
