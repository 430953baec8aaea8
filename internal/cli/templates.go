package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

func (a *app) templateCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"templates"}, Short: "Inspect templates"}
	cmd.AddCommand(&cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List template releases and their tags",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.checkOutput(); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			list, err := c.ListTemplates(cmdContext(cmd))
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(list)
			}
			tw := a.table("NAME", "TAGS", "DIGEST", "SIZE", "CREATED")
			for _, t := range list {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.Name, strings.Join(t.Tags, ","), t.Digest, humanBytes(t.SizeBytes), ago(t.CreatedAt))
			}
			return tw.Flush()
		},
	})
	return cmd
}
