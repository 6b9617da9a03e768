"""The autoscaler benchmark: a fleet simulator, the baselines it is compared with, and
`switchyard bench autoscale`."""
