"""nbgrader settings of the images (copied to /etc/jupyter/), read wherever nbgrader runs
in them: the course id of grading/nbgrader_config.py and the exchange folder that the
compose file and docker/jupyterhub_config.py mount a shared volume on."""

c = get_config()  # noqa: F821  (provided by traitlets)
c.CourseDirectory.course_id = "minivllm-precision"
c.Exchange.root = "/srv/nbgrader/exchange"
