"""What the gateway can take on: the door (per-connection and per-tenant work before a
request is read), the per-pool admission queues, leases on replica slots, the pools'
membership and the balancer. Knows nothing of the serving path."""
