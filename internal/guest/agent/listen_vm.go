package agent

import (
	"context"
	"fmt"
	"net"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// In a VM the kernel starts space-agent as /init of the initramfs. Before anything else
// runs, vmboot mounts the root disk, switches to it and re-executes the agent from there
// (as wire.AgentPath), so that the rest of this package only ever runs in the final
// root. This hook sits here, in package agent, because every binary that runs the agent
// imports it; it does nothing unless the process is PID 1 started as /init.
func init() {
	if vmboot.IsInit() {
		vmboot.Main() // never returns
	}
}

// listenSerial serves on a virtio-serial port ("serial:space.agent" or
// "serial:/dev/vport1p1"): yamux streams multiplexed over the port, re-established
// whenever the host reconnects (see package vmboot).
func listenSerial(ctx context.Context, dev string) (net.Listener, error) {
	ln, err := vmboot.Listen(ctx, dev, nil)
	if err != nil {
		return nil, fmt.Errorf("listen serial:%s: %w", dev, err)
	}
	return ln, nil
}
