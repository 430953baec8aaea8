package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/term"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// runInteractive runs a command with this terminal's stdin forwarded and, with tty, on
// a pseudo-terminal in raw mode that follows this terminal's size, and returns its exit
// event once the terminal is restored.
func runInteractive(ctx context.Context, env *Env, c *client.Client, sandbox string, req api.CreateSessionRequest, tty bool) (*api.ExitEvent, error) {
	req.Stdin = true
	in, isFile := env.Stdin.(*os.File)
	if tty {
		rows, cols := 24, 80
		if isFile && term.IsTerminal(int(in.Fd())) {
			if w, h, err := term.GetSize(int(in.Fd())); err == nil {
				rows, cols = h, w
			}
		}
		req.PTY = &api.PTYSize{Rows: rows, Cols: cols}
	}
	sess, err := c.CreateSession(ctx, sandbox, req)
	if err != nil {
		return nil, err
	}
	if tty && isFile && term.IsTerminal(int(in.Fd())) {
		old, err := term.MakeRaw(int(in.Fd()))
		if err != nil {
			return nil, fmt.Errorf("raw terminal: %w", err)
		}
		defer term.Restore(int(in.Fd()), old)
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for range winch {
				if w, h, err := term.GetSize(int(in.Fd())); err == nil {
					_ = c.Resize(ctx, sess, h, w)
				}
			}
		}()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	started := make(chan struct{})
	var once bool
	go func() {
		<-started
		buf := make([]byte, 32<<10)
		for {
			n, err := env.Stdin.Read(buf)
			if n > 0 {
				if c.WriteStdin(ctx, sess, bytes.NewReader(buf[:n]), false) != nil {
					return
				}
			}
			if err != nil {
				if !tty {
					_ = c.WriteStdin(ctx, sess, bytes.NewReader(nil), true)
				}
				return
			}
		}
	}()
	return c.Follow(ctx, sess, client.Output{Stdout: env.Stdout, Stderr: env.Stderr,
		OnStart: func(api.StartEvent) {
			if !once {
				once = true
				close(started)
			}
		}})
}
