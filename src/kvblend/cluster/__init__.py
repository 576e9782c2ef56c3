"""``kvblend serve --replicas N``: the service as a Ray Serve application (the ``cluster``
extra, ``pip install kvblend[cluster]``). Only this package imports ray; the single-process
server never does. Modules: ``wire`` (what crosses the hop), ``remote`` (the ingress's
scheduler stand-in), ``model`` (the model replicas), ``ingress`` (the HTTP app),
``metrics`` (``/metrics`` over every replica), ``affinity`` and ``router`` (document-affinity
routing), ``app`` (building, starting and stopping the application)."""
