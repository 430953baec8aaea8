package node

import "context"

// runBuilds executes template builds assigned to this node until ctx ends.
func (n *Node) runBuilds(ctx context.Context) {
	<-ctx.Done()
}
