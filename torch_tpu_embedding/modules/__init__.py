"""The modules: tables, stacked groups, lookups and ``EmbeddingCollection``.

``collection`` (:class:`~torch_tpu_embedding.EmbeddingCollection`), ``table`` (one table's weight),
``stacking`` (tables of one shape stacked in one buffer), ``lookup`` (the row-sparse lookup),
``screening`` (ids checked on the device) and ``deferred_init`` (tables built on the meta device).
The public names are re-exported by :mod:`torch_tpu_embedding`.
"""
