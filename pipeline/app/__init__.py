"""The app layer: what runs the stages for users (command line, Python API, supervisor,
pipeline hosts, HTTP live view, Prometheus, MQTT). It may import ``stages``; the runtime
core (``pipeline`` itself) imports neither ``stages`` nor this package
(``tests/test_layers.py``)."""
