package cli

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/ids"
)

// splitRemote parses SANDBOX:PATH; ok is false for a local path.
func splitRemote(arg string) (sandbox, path string, ok bool) {
	sb, p, found := strings.Cut(arg, ":")
	if !found || !ids.ValidSandbox(sb) || p == "" {
		return "", "", false
	}
	return sb, p, true
}

func (a *app) cpCmd() *cobra.Command {
	var user string
	cmd := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file into or out of a sandbox (SANDBOX:PATH on one side; - is stdin/stdout)",
		Long: `Copy a file between this machine and a sandbox. One side is SANDBOX:PATH (a path
inside the sandbox, absolute or relative to the user's home), the other a local path
or - for stdin/stdout. Files stream in both directions without being held in memory;
missing parent directories in the sandbox are created.`,
		Example: "  space cp ./data.csv $id:/home/user/data.csv\n  space cp $id:/tmp/result.json .\n  tar cz src | space cp - $id:/tmp/src.tgz",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			srcSB, srcPath, srcRemote := splitRemote(args[0])
			dstSB, dstPath, dstRemote := splitRemote(args[1])
			opts := client.FileOptions{User: user}
			switch {
			case srcRemote == dstRemote:
				return fmt.Errorf("exactly one of SRC and DST must be SANDBOX:PATH")
			case dstRemote:
				var in io.Reader = a.env.Stdin
				if args[0] != "-" {
					f, err := os.Open(args[0])
					if err != nil {
						return err
					}
					defer f.Close()
					fi, err := f.Stat()
					if err != nil {
						return err
					}
					if fi.IsDir() {
						return fmt.Errorf("%s is a directory; copy an archive instead (tar c dir | space cp - %s)", args[0], args[1])
					}
					opts.Mode = uint32(fi.Mode().Perm())
					in = f
					if strings.HasSuffix(dstPath, "/") {
						dstPath += filepath.Base(args[0])
					}
				}
				_, err := c.WriteFile(ctx, dstSB, dstPath, in, opts)
				return err
			default:
				rc, err := c.ReadFile(ctx, srcSB, srcPath, opts)
				if err != nil {
					return err
				}
				defer rc.Close()
				if args[1] == "-" {
					_, err = io.Copy(a.env.Stdout, rc)
					return err
				}
				dst := args[1]
				if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
					dst = filepath.Join(dst, filepath.Base(srcPath))
				}
				tmp, err := os.CreateTemp(filepath.Dir(dst), ".space-cp-*")
				if err != nil {
					return err
				}
				defer os.Remove(tmp.Name())
				if _, err := io.Copy(tmp, rc); err != nil {
					tmp.Close()
					return err
				}
				if err := tmp.Close(); err != nil {
					return err
				}
				return os.Rename(tmp.Name(), dst)
			}
		},
	}
	cmd.Flags().StringVarP(&user, "user", "u", "", "user inside the sandbox (owner of written files; home for relative paths)")
	return cmd
}
