// Command space is the space server in all its roles (space serve) and its CLI.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/internal/cli"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

// defaultDataDir is /var/lib/space for root, else ~/.local/share/space.
func defaultDataDir() string {
	if d := os.Getenv("SPACE_DATA_DIR"); d != "" {
		return d
	}
	if os.Geteuid() == 0 {
		return "/var/lib/space"
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "share", "space")
	}
	return "/var/lib/space"
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	root := &cobra.Command{
		Use:   "space",
		Short: "space runs untrusted code in isolated sandboxes",
		Long: `space is a self-hostable platform that runs untrusted, agent-generated code in
isolated sandboxes (gVisor, or microVMs where the host allows). Applications drive it
over HTTP; command output streams back as Server-Sent Events.

Start the server with "space serve"; the other commands are its CLI. The CLI talks to
SPACE_URL (default http://127.0.0.1:7700) with SPACE_API_KEY, falling back to the local
server's <data-dir>/admin.key.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version,
	}
	dataDir := defaultDataDir()
	env := &cli.Env{
		URL:     envOr("SPACE_URL", "http://127.0.0.1:7700"),
		APIKey:  os.Getenv("SPACE_API_KEY"),
		DataDir: dataDir,
		Stdin:   os.Stdin,
		Stdout:  os.Stdout,
		Stderr:  os.Stderr,
	}
	root.PersistentFlags().StringVar(&env.DataDir, "data-dir", dataDir, "data directory (env SPACE_DATA_DIR)")
	root.AddCommand(serveCmd(env))
	cli.AddCommands(root, env)

	err := root.ExecuteContext(ctx)
	var exit *cli.ExitError
	switch {
	case errors.As(err, &exit):
		os.Exit(exit.Code)
	case err != nil:
		fmt.Fprintln(os.Stderr, "space:", err)
		os.Exit(1)
	}
}
