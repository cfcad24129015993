"""Stand-ins for a deployment's services, on loopback, that tests and benchmarks start: PostgreSQL and an S3 server
for the lake (lake_services.py), and a store under attack with mutated inputs (store_attack.py)."""
