{{/* Names, labels and the values several objects share. */}}

{{- define "sandboxd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object; the longest suffix added is "-gateway" (8): 63 - 8 = 55. */}}
{{- define "sandboxd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" -}}
{{- else if contains (include "sandboxd.name" .) .Release.Name -}}
{{- .Release.Name | trunc 55 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "sandboxd.name" .) | trunc 55 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sandboxd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "sandboxd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "sandboxd.selector" -}}
app.kubernetes.io/name: {{ include "sandboxd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sandboxd.gatewayImage" -}}
{{ .Values.gateway.image.repository }}:{{ .Values.gateway.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "sandboxd.agentImage" -}}
{{ .Values.agents.image.repository }}:{{ .Values.agents.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "sandboxd.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "sandboxd.fullname" .)) -}}
{{- end -}}

{{- define "sandboxd.cnpgName" -}}
{{- printf "%s-pg" (include "sandboxd.fullname" .) -}}
{{- end -}}

{{/* The gateway Service's address inside the cluster, as agents reach it. */}}
{{- define "sandboxd.gatewayUrl" -}}
http://{{ include "sandboxd.fullname" . }}-gateway.{{ .Release.Namespace }}.svc:{{ .Values.service.port }}
{{- end -}}

{{/*
DATABASE_URL (and SANDBOXD_DATABASE_LISTEN_URL) from a Secret, never a value in the pod spec:
the CNPG cluster's app Secret, or the operator's own. `listen` true: the variable the migration
Job uses, a direct connection where a pooler is in front.
*/}}
{{- define "sandboxd.databaseEnv" -}}
{{- $v := .root.Values.database -}}
{{- if $v.cnpg.enabled }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sandboxd.cnpgName" .root }}-app
      key: uri
{{- else }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.external.existingSecret is required without database.cnpg.enabled" $v.external.existingSecret }}
      key: {{ if and .forMigration $v.external.listenUrlKey }}{{ $v.external.listenUrlKey }}{{ else }}{{ $v.external.urlKey }}{{ end }}
{{- if and $v.external.listenUrlKey (not .forMigration) }}
- name: SANDBOXD_DATABASE_LISTEN_URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.external.existingSecret }}
      key: {{ $v.external.listenUrlKey }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "sandboxd.metricsEnv" -}}
{{- if .Values.metrics.enabled }}
- name: SANDBOXD_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sandboxd.secretName" . }}
      key: metrics-token
{{- end }}
{{- end -}}

{{/* Operator settings as environment variables (values.schema.json refuses secret names). */}}
{{- define "sandboxd.settingsEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}
