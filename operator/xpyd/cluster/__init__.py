"""The local Kubernetes control plane for e2e tests and the demo: real etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on loopback, kwok-managed fake GPU nodes, and a pod
process runtime that runs the operator, proxy and emulated engines as real local processes."""
