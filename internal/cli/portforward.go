package cli

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/client"
)

// portPair is one LOCAL:REMOTE of `space port-forward`.
type portPair struct{ local, remote int }

func parsePortPair(s string) (portPair, error) {
	l, r, ok := strings.Cut(s, ":")
	if !ok {
		l, r = s, s
	}
	var p portPair
	var err error
	if l == "" {
		p.local = 0 // any free port
	} else if p.local, err = strconv.Atoi(l); err != nil || p.local < 0 || p.local > 65535 {
		return p, fmt.Errorf("port %q: want [LOCAL:]REMOTE with ports 1-65535 (LOCAL 0 or empty: any free port)", s)
	}
	if p.remote, err = strconv.Atoi(r); err != nil || p.remote < 1 || p.remote > 65535 {
		return p, fmt.Errorf("port %q: want [LOCAL:]REMOTE with ports 1-65535", s)
	}
	return p, nil
}

func (a *app) portForwardCmd() *cobra.Command {
	var address string
	cmd := &cobra.Command{
		Use:   "port-forward ID [LOCAL:]REMOTE...",
		Short: "Forward local ports to ports inside a sandbox",
		Long: `Listen on local ports and forward every connection to a port inside the sandbox,
like kubectl port-forward. The connection travels through the space API and the
sandbox's agent, which connects inside the sandbox: the sandbox needs no network of
its own (it works with egress none) and gets no routable address. Runs until
interrupted; a connection to a port nobody listens on in the sandbox is closed and
reported.

For HTTP, the API also proxies directly: /v1/sandboxes/ID/ports/PORT/PATH.`,
		Example: `  space port-forward $id 8080:80
  space port-forward $id 3000 5432:5432
  space port-forward $id :8000        # any free local port`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			var pairs []portPair
			for _, s := range args[1:] {
				p, err := parsePortPair(s)
				if err != nil {
					return err
				}
				pairs = append(pairs, p)
			}
			ctx, cancel := context.WithCancel(cmdContext(cmd))
			defer cancel()
			// The sandbox must exist (and be the caller's) before anything listens.
			if _, err := c.GetSandbox(ctx, args[0]); err != nil {
				return err
			}
			var lns []net.Listener
			defer func() {
				for _, l := range lns {
					l.Close()
				}
			}()
			for _, p := range pairs {
				l, err := net.Listen("tcp", net.JoinHostPort(address, strconv.Itoa(p.local)))
				if err != nil {
					return fmt.Errorf("listen for port %d: %w", p.remote, err)
				}
				lns = append(lns, l)
				fmt.Fprintf(a.env.Stdout, "Forwarding from %s -> %d\n", l.Addr(), p.remote)
			}
			var wg sync.WaitGroup
			for i, l := range lns {
				wg.Add(1)
				go func() {
					defer wg.Done()
					a.forward(ctx, c, args[0], l, pairs[i].remote)
				}()
			}
			<-ctx.Done()
			for _, l := range lns {
				l.Close()
			}
			wg.Wait()
			return nil
		},
	}
	cmd.Flags().StringVar(&address, "address", "127.0.0.1", "local address to listen on")
	return cmd
}

// forward accepts connections on l and relays each to port in the sandbox.
func (a *app) forward(ctx context.Context, c *client.Client, id string, l net.Listener, port int) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer conn.Close()
			up, err := c.DialPort(ctx, id, port)
			if err != nil {
				if ctx.Err() == nil {
					fmt.Fprintf(a.env.Stderr, "port %d: %v\n", port, err)
				}
				return
			}
			defer up.Close()
			var once sync.Once
			stop := func() { once.Do(func() { conn.Close(); up.Close() }) }
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(up, conn); stop(); done <- struct{}{} }()
			go func() { _, _ = io.Copy(conn, up); stop(); done <- struct{}{} }()
			select {
			case <-done:
			case <-ctx.Done():
			}
			stop()
		}()
	}
}
