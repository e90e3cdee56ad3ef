/** Every command the extension adds, under `rapydli:*`. */
export const CommandIDs = {
  openPanel: 'rapydli:open-panel',
  refresh: 'rapydli:refresh',
  startCluster: 'rapydli:start-cluster',
  restartCluster: 'rapydli:restart-cluster',
  stopCluster: 'rapydli:stop-cluster',
  whereCluster: 'rapydli:where-cluster',
  insertDistributedCell: 'rapydli:insert-distributed-cell',
  openRun: 'rapydli:open-run',
  openCompare: 'rapydli:open-compare'
} as const;
