"""The development cluster (`kiln dev-cluster`): a fake Kubernetes API server (`api`), a node
agent that runs pods as local processes (`node`), the process that serves both (`cluster`) and
the command that starts and stops them with the real operator (`command`). A test harness for
one machine, not a Kubernetes."""
