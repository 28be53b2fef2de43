"""Ground floor of airflow-drl-executor: the wire schema, the placement interface, the pool
catalogue, the heuristics, and (with the ``policy`` extra) the GNN model and the policy server.

Importing this package imports neither torch nor Airflow.
"""
